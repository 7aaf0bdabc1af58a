// The AVX-512 intrinsics the kernels use, on every x86-64 CPU with AVX2, FMA and F16C.
//
// Compiled for AVX-512 (with BF16 and VNNI), this is <immintrin.h> and a few helpers; for AVX-512 with VNNI
// but no BF16, the two bfloat16 instructions the kernels use are made of AVX-512F ones. Compiled for AVX2
// (most CPUs without AVX-512: Zen 1-3, Intel client cores), each 512-bit register becomes two 256-bit
// halves in a struct and each intrinsic a function with the instruction's own result, so the kernels'
// sources stay one; where the CPU also has AVX-VNNI, the int8 dot products are its 256-bit VPDPBUSD. Without it an AVX2 machine took dense weights, far slower than the emulated kernels
// (docs/decisions.md, "AVX-512 kernels emulated on AVX2"). Results equal the
// instructions' but for denormal inputs to the bfloat16 ones (the hardware reads them as zero) and
// for _mm512_scalef_ps outside the exponents [-252, 254]. The sources name a few operations that are
// no single intrinsic: as_bf16_pairs (a cast) and VPDPBUSD over narrower bytes (nibble_* chains and
// dpbusd_offset128_*), which the emulation does in fewer instructions; and, in either build, the
// widening of bfloat16 to float32 every kernel does (bf16_to_ps, bf16_even_ps, bf16_odd_ps).
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)

// A 512-bit integer register read as 32 bfloat16 values (a no-op).
inline __m512bh as_bf16_pairs(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// A chain of at most eight _mm512_dpbusd_epi32 from zero over 4-bit codes `a` (bytes 0..15):
// nibble_dot adds one, nibble_total gives the int32 sums. Here a nibble_sum is the int32 sums; the AVX2
// emulation keeps pairs of products in 16 bits (8 * 2 * 15 * 128 < 2^15) and widens them once.
using nibble_sum = __m512i;
inline nibble_sum nibble_zero() { return _mm512_setzero_si512(); }
inline nibble_sum nibble_dot(nibble_sum sum, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(sum, a, b); }
inline __m512i nibble_total(nibble_sum sum) { return sum; }

// _mm512_dpbusd_epi32 over bytes `a` stored plus 128 and `b` in -127..127, a sum started at
// dpbusd_offset128_start(the sum of b's bytes): together they sum (a - 128) * b. Here the start takes
// the offset off; the AVX2 emulation multiplies a - 128 directly.
inline int32_t dpbusd_offset128_start(int32_t b_sum) { return -128 * b_sum; }
inline __m512i dpbusd_offset128_epi32(__m512i src, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(src, a, b); }

#if !defined(__AVX512BF16__)
// AVX-512 with VNNI but without its bfloat16 instructions (Cascade Lake, Ice Lake, Tiger Lake): the two
// the kernels use, made of AVX-512F instructions with the AVX2 emulation's results below (the
// instructions' but for denormal inputs). Without this build such a CPU ran the AVX2 emulation of every
// kernel, at half the vector width and with VNNI emulated too (docs/decisions.md, "AVX-512 without
// BF16 gets its own build").
namespace avx512_without_bf16 {

// 16 float32 rounded to bfloat16, to nearest even; NaNs stay (quiet) NaNs.
inline __m256bh cvtneps_pbh(__m512 a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i top = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(top, _mm512_set1_epi32(1)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __m512i nan = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
  const __m512i words = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), rounded, nan);
  return reinterpret_cast<__m256bh>(_mm512_cvtepi32_epi16(words));
}

// Per float lane, src + a_odd * b_odd + a_even * b_even over bfloat16 pairs (each product exact in
// float32, so a fused multiply-add rounds as the instruction's add does).
inline __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  const __m512i x = reinterpret_cast<__m512i>(a), y = reinterpret_cast<__m512i>(b);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                                     _mm512_castsi512_ps(_mm512_and_si512(y, high)), src);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(y, 16)),
                         odd);
}

}  // namespace avx512_without_bf16

#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh avx512_without_bf16::cvtneps_pbh
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps avx512_without_bf16::dpbf16_ps
#endif

#else

#include <cstdint>
#include <cstring>

#define AVX2_INLINE inline __attribute__((always_inline))

namespace avx512_on_avx2 {

// A 512-bit register as its two 256-bit halves (kept in two ymm registers once inlined); integer
// registers and bfloat16 pairs are one type.
struct f32x16 {
  __m256 lo, hi;
};
struct i32x16 {
  __m256i lo, hi;
};

// A register's lanes as an array, for the rarer intrinsics (through memory).
template <class T, int kCount, class V = i32x16>
struct Lanes {
  alignas(32) T v[kCount];
  Lanes() = default;
  AVX2_INLINE explicit Lanes(V a) { std::memcpy(v, &a, sizeof(v)); }
  AVX2_INLINE V get() const {
    V out;
    std::memcpy(&out, v, sizeof(v));
    return out;
  }
};
using Floats = Lanes<float, 16, f32x16>;
template <class T, int kCount>
using Ints = Lanes<T, kCount>;

// All ones in the lanes (of eight, from `first`) whose bit of `mask` is set.
AVX2_INLINE __m256i lane_mask(uint32_t mask, int first) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i bits = _mm256_set1_epi32(static_cast<int32_t>(mask >> first & 0xFF));
  return _mm256_cmpeq_epi32(_mm256_and_si256(bits, bit), bit);
}
AVX2_INLINE f32x16 select(uint32_t mask, f32x16 yes, f32x16 no) {
  return {_mm256_blendv_ps(no.lo, yes.lo, _mm256_castsi256_ps(lane_mask(mask, 0))),
          _mm256_blendv_ps(no.hi, yes.hi, _mm256_castsi256_ps(lane_mask(mask, 8)))};
}

// ---- float arithmetic ----
AVX2_INLINE f32x16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AVX2_INLINE f32x16 set1_ps(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
AVX2_INLINE f32x16 setr_ps(float a0, float a1, float a2, float a3, float a4, float a5, float a6, float a7,
                           float a8, float a9, float a10, float a11, float a12, float a13, float a14, float a15) {
  return {_mm256_setr_ps(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_ps(a8, a9, a10, a11, a12, a13, a14, a15)};
}
// A binary intrinsic as its 256-bit counterpart on each half.
#define AVX2_PER_HALF(type, name, op) \
  AVX2_INLINE type name(type a, type b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
AVX2_PER_HALF(f32x16, add_ps, _mm256_add_ps)
AVX2_PER_HALF(f32x16, sub_ps, _mm256_sub_ps)
AVX2_PER_HALF(f32x16, mul_ps, _mm256_mul_ps)
AVX2_PER_HALF(f32x16, div_ps, _mm256_div_ps)
AVX2_PER_HALF(f32x16, max_ps, _mm256_max_ps)
AVX2_PER_HALF(f32x16, min_ps, _mm256_min_ps)
AVX2_INLINE f32x16 fmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
AVX2_INLINE f32x16 fnmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
AVX2_INLINE f32x16 abs_ps(f32x16 a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}

// Reductions in the order GCC's own _mm512_reduce_*_ps take: halves, quarters, then pairs.
#define AVX2_REDUCE_PS(name, op256, op128)                                               \
  AVX2_INLINE float name(f32x16 v) {                                                    \
    const __m256 eight = op256(v.hi, v.lo);                                              \
    const __m128 four = op128(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight)); \
    const __m128 two = op128(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2))); \
    return _mm_cvtss_f32(op128(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(1, 1, 1, 1)))); \
  }
AVX2_REDUCE_PS(reduce_add_ps, _mm256_add_ps, _mm_add_ps)
AVX2_REDUCE_PS(reduce_max_ps, _mm256_max_ps, _mm_max_ps)

// Only the lanes a mask names are read or written: the others may lie past the end of a buffer.
AVX2_INLINE f32x16 loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
AVX2_INLINE void storeu_ps(void* p, f32x16 v) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, v.lo), _mm256_storeu_ps(f + 8, v.hi);
}
AVX2_INLINE f32x16 maskz_loadu_ps(uint32_t mask, const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_maskload_ps(f, lane_mask(mask, 0)), _mm256_maskload_ps(f + 8, lane_mask(mask, 8))};
}
AVX2_INLINE void mask_storeu_ps(void* p, uint32_t mask, f32x16 v) {
  float* f = static_cast<float*>(p);
  _mm256_maskstore_ps(f, lane_mask(mask, 0), v.lo), _mm256_maskstore_ps(f + 8, lane_mask(mask, 8), v.hi);
}
AVX2_INLINE f32x16 mask_mov_ps(f32x16 src, uint32_t mask, f32x16 a) { return select(mask, a, src); }
AVX2_INLINE f32x16 mask_add_ps(f32x16 src, uint32_t mask, f32x16 a, f32x16 b) {
  return select(mask, add_ps(a, b), src);
}
AVX2_INLINE f32x16 mask_max_ps(f32x16 src, uint32_t mask, f32x16 a, f32x16 b) {
  return select(mask, max_ps(a, b), src);
}

template <int kPredicate>
AVX2_INLINE __mmask16 cmp_ps_mask(f32x16 a, f32x16 b) {
  const int low = _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kPredicate));
  const int high = _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kPredicate));
  return static_cast<__mmask16>(low | high << 8);
}

template <int kImmediate>
AVX2_INLINE f32x16 roundscale_ps(f32x16 a) {
  static_assert((kImmediate >> 4) == 0, "only rounding to whole numbers is emulated");
  return {_mm256_round_ps(a.lo, kImmediate), _mm256_round_ps(a.hi, kImmediate)};
}

// a * 2^floor(b), in two exact steps of at most 2^127 each so no power of two overflows.
AVX2_INLINE __m256 scalef_half(__m256 a, __m256 b) {
  const __m256 floor = _mm256_min_ps(_mm256_max_ps(_mm256_floor_ps(b), _mm256_set1_ps(-252)), _mm256_set1_ps(254));
  const __m256i n = _mm256_cvttps_epi32(floor);
  const __m256i first = _mm256_srai_epi32(_mm256_add_epi32(n, _mm256_srli_epi32(n, 31)), 1);  // n / 2
  const __m256i second = _mm256_sub_epi32(n, first);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first_power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 second_power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, first_power), second_power);
}
AVX2_INLINE f32x16 scalef_ps(f32x16 a, f32x16 b) { return {scalef_half(a.lo, b.lo), scalef_half(a.hi, b.hi)}; }

// ---- conversions ----
AVX2_INLINE f32x16 cvtph_ps(__m256i halves) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))};
}
AVX2_INLINE i32x16 cvtps_epi32(f32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
AVX2_INLINE f32x16 cvtepi32_ps(i32x16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
// 16 int32 lanes to their low 16 bits, in order.
AVX2_INLINE __m256i low_words(i32x16 a) {
  const __m256i word = _mm256_set1_epi32(0xFFFF);
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(a.lo, word), _mm256_and_si256(a.hi, word));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}
AVX2_INLINE __m256i cvtepi32_epi16(i32x16 a) { return low_words(a); }
AVX2_INLINE __m128i cvtepi32_epi8(i32x16 a) {
  const __m256i words = _mm256_and_si256(low_words(a), _mm256_set1_epi16(0xFF));
  return _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
AVX2_INLINE i32x16 cvtepu8_epi32(__m128i a) { return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))}; }
AVX2_INLINE i32x16 cvtepi8_epi32(__m128i a) { return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
AVX2_INLINE i32x16 cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}

// bfloat16 rounded to nearest even; NaNs stay (quiet) NaNs.
AVX2_INLINE __m256i bfloat16_half(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i top = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(top, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
AVX2_INLINE __m256bh cvtneps_pbh(f32x16 a) {
  return reinterpret_cast<__m256bh>(low_words({bfloat16_half(a.lo), bfloat16_half(a.hi)}));
}

// ---- integers ----
AVX2_INLINE i32x16 set1_epi32(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
AVX2_INLINE i32x16 set1_epi8(char x) { return {_mm256_set1_epi8(x), _mm256_set1_epi8(x)}; }
AVX2_INLINE i32x16 setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                              int a10, int a11, int a12, int a13, int a14, int a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}
AVX2_PER_HALF(i32x16, add_epi32, _mm256_add_epi32)
AVX2_PER_HALF(i32x16, and_si512, _mm256_and_si256)
AVX2_PER_HALF(i32x16, or_si512, _mm256_or_si256)
#define AVX2_SHIFT(name, op) \
  AVX2_INLINE i32x16 name(i32x16 a, unsigned int count) { return {op(a.lo, count), op(a.hi, count)}; }
AVX2_SHIFT(slli_epi32, _mm256_slli_epi32)
AVX2_SHIFT(srli_epi32, _mm256_srli_epi32)
AVX2_SHIFT(srli_epi16, _mm256_srli_epi16)
AVX2_SHIFT(slli_epi16, _mm256_slli_epi16)
AVX2_INLINE int32_t reduce_add_epi32(i32x16 a) {
  const __m256i eight = _mm256_add_epi32(a.lo, a.hi);
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  const __m128i two = _mm_add_epi32(four, _mm_shuffle_epi32(four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, _MM_SHUFFLE(1, 1, 1, 1))));
}
AVX2_INLINE i32x16 mask_mov_epi32(i32x16 src, uint32_t mask, i32x16 a) {
  return {_mm256_blendv_epi8(src.lo, a.lo, lane_mask(mask, 0)), _mm256_blendv_epi8(src.hi, a.hi, lane_mask(mask, 8))};
}

AVX2_INLINE f32x16 castsi512_ps(i32x16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
AVX2_INLINE i32x16 castps_si512(f32x16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
AVX2_INLINE i32x16 castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
template <int kHalf>
AVX2_INLINE i32x16 inserti64x4(i32x16 a, __m256i b) {
  return kHalf & 1 ? i32x16{a.lo, b} : i32x16{b, a.hi};
}

AVX2_INLINE i32x16 loadu_si512(const void* p) {
  const __m256i* v = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
AVX2_INLINE void storeu_si512(void* p, i32x16 a) {
  __m256i* v = static_cast<__m256i*>(p);
  _mm256_storeu_si256(v, a.lo), _mm256_storeu_si256(v + 1, a.hi);
}
// The 16-bit words a mask names, read from `p` (the others zero) or written to it (the others left).
template <int kLanes>
AVX2_INLINE void load_words(uint32_t mask, const void* p, int16_t* words) {
  for (int i = 0; i < kLanes; ++i) words[i] = mask >> i & 1 ? static_cast<const int16_t*>(p)[i] : 0;
}
template <int kLanes>
AVX2_INLINE void store_words(uint32_t mask, void* p, const int16_t* words) {
  for (int i = 0; i < kLanes; ++i) {
    if (mask >> i & 1) static_cast<int16_t*>(p)[i] = words[i];
  }
}
AVX2_INLINE i32x16 maskz_loadu_epi16(uint32_t mask, const void* p) {
  if (mask == 0xFFFFFFFFu) return loadu_si512(p);
  Ints<int16_t, 32> words;
  load_words<32>(mask, p, words.v);
  return words.get();
}
AVX2_INLINE void mask_storeu_epi16(void* p, uint32_t mask, i32x16 a) {
  if (mask == 0xFFFFFFFFu) return storeu_si512(p, a);
  store_words<32>(mask, p, Ints<int16_t, 32>(a).v);
}
AVX2_INLINE __m256i maskz_loadu_epi16_256(uint32_t mask, const void* p) {
  if ((mask & 0xFFFF) == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) int16_t words[16];
  load_words<16>(mask, p, words);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(words));
}
AVX2_INLINE void mask_storeu_epi16_256(void* p, uint32_t mask, __m256i a) {
  if ((mask & 0xFFFF) == 0xFFFF) return _mm256_storeu_si256(static_cast<__m256i*>(p), a);
  alignas(32) int16_t words[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), a);
  store_words<16>(mask, p, words);
}

// ---- lane movement ----
template <int kImmediate>
AVX2_INLINE f32x16 shuffle_ps(f32x16 a, f32x16 b) {
  return {_mm256_shuffle_ps(a.lo, b.lo, kImmediate), _mm256_shuffle_ps(a.hi, b.hi, kImmediate)};
}
// 128-bit lanes 0-3 (lo's two, then hi's): the result's first two picked from a, the last two from b.
template <int kImmediate>
AVX2_INLINE f32x16 shuffle_f32x4(f32x16 a, f32x16 b) {
  constexpr int kLow = (kImmediate & 3) | (kImmediate >> 2 & 3) << 4, kHigh = (kImmediate >> 4 & 3) | (kImmediate >> 6 & 3) << 4;
  return {_mm256_permute2f128_ps(a.lo, a.hi, kLow), _mm256_permute2f128_ps(b.lo, b.hi, kHigh)};
}
AVX2_INLINE f32x16 permutexvar_ps(i32x16 index, f32x16 a) {
  const Floats values(a);
  const Ints<int32_t, 16> at(index);
  Floats out;
  for (int i = 0; i < 16; ++i) out.v[i] = values.v[at.v[i] & 15];
  return out.get();
}
AVX2_INLINE i32x16 permutexvar_epi16(i32x16 index, i32x16 a) {
  const Ints<int16_t, 32> words(a), at(index);
  Ints<int16_t, 32> out;
  for (int i = 0; i < 32; ++i) out.v[i] = words.v[at.v[i] & 31];
  return out.get();
}
// The lanes a mask names, packed to the front in order; the rest zero.
template <class Array, class V>
AVX2_INLINE V compress(uint32_t mask, V a) {
  if ((mask & 0xFFFF) == 0xFFFF) return a;  // every lane kept (the common case): nothing moves
  const Array values(a);
  Array out{};
  int kept = 0;
  for (int i = 0; i < 16; ++i) {
    if (mask >> i & 1) out.v[kept++] = values.v[i];
  }
  return out.get();
}
AVX2_INLINE f32x16 maskz_compress_ps(uint32_t mask, f32x16 a) { return compress<Floats>(mask, a); }
AVX2_INLINE i32x16 maskz_compress_epi32(uint32_t mask, i32x16 a) { return compress<Ints<int32_t, 16>>(mask, a); }

// ---- dot products ----
#if defined(__AVXVNNI__)
// AVX-VNNI (the 256-bit VPDPBUSD without AVX-512: Intel cores since Alder Lake, Xeon 6 E-cores): the
// instruction itself, one per 32 byte products where AVX2 takes six (docs/decisions.md, "AVX2 with
// AVX-VNNI gets its own build").
AVX2_INLINE __m256i dpbusd_half(__m256i src, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(src, u, s); }
#else
// Per int32 lane, src + the sum of four unsigned-by-signed byte products (no saturation): bytes
// widened to 16 bits, even and odd ones apart, so each VPMADDWD sum stays exact.
AVX2_INLINE __m256i dpbusd_half(__m256i src, __m256i u, __m256i s) {
  const __m256i even = _mm256_madd_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0xFF)),
                                         _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8));
  const __m256i odd = _mm256_madd_epi16(_mm256_srli_epi16(u, 8), _mm256_srai_epi16(s, 8));
  return _mm256_add_epi32(src, _mm256_add_epi32(even, odd));
}
#endif
AVX2_INLINE i32x16 dpbusd_epi32(i32x16 src, i32x16 a, i32x16 b) {
  return {dpbusd_half(src.lo, a.lo, b.lo), dpbusd_half(src.hi, a.hi, b.hi)};
}
// Ends GCC's view into a sum: without it GCC reassociates a row tile's chains of integer dot
// products into trees of all the products, which spill out of the 16 ymm registers (a multi-row
// matmul ran far slower: docs/decisions.md, "AVX-512 kernels emulated on AVX2").
AVX2_INLINE void keep_chain(__m256i& lo, __m256i& hi) { asm("" : "+x"(lo), "+x"(hi)); }

#if defined(__AVXVNNI__)
// With VPDPBUSD itself, the 4-bit chains and the offset bytes take it as the AVX-512 build does.
using nibble_sum = i32x16;
AVX2_INLINE nibble_sum nibble_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
AVX2_INLINE nibble_sum nibble_dot(nibble_sum sum, i32x16 a, i32x16 b) { return dpbusd_epi32(sum, a, b); }
AVX2_INLINE i32x16 nibble_total(nibble_sum sum) { return sum; }
AVX2_INLINE i32x16 dpbusd_offset128_epi32(i32x16 src, i32x16 a, i32x16 b) { return dpbusd_epi32(src, a, b); }
AVX2_INLINE int32_t dpbusd_offset128_start(int32_t b_sum) { return -128 * b_sum; }
#else
// Chains over 4-bit codes: VPMADDUBSW's pairs of products stay far inside int16 (no saturation), so
// eight of them add up in 16-bit lanes and one VPMADDWD per chain widens them (a quarter of the general
// case's instructions per product).
struct nibble_sum {
  __m256i lo, hi;  // int16 sums of product pairs
};
AVX2_INLINE nibble_sum nibble_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
AVX2_INLINE nibble_sum nibble_dot(nibble_sum sum, i32x16 a, i32x16 b) {
  nibble_sum out{_mm256_add_epi16(sum.lo, _mm256_maddubs_epi16(a.lo, b.lo)),
                 _mm256_add_epi16(sum.hi, _mm256_maddubs_epi16(a.hi, b.hi))};
  keep_chain(out.lo, out.hi);
  return out;
}
AVX2_INLINE i32x16 nibble_total(nibble_sum sum) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(sum.lo, ones), _mm256_madd_epi16(sum.hi, ones)};
}
// src + the sum of (a - 128) * b over a's bytes stored plus 128 and b in -127..127: a - 128 as a signed
// byte c, |c| (128 read unsigned) times b with c's sign, so again no pair of products leaves int16.
AVX2_INLINE __m256i dpbusd_offset128_half(__m256i src, __m256i u, __m256i s) {
  const __m256i c = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(s, c));
  return _mm256_add_epi32(src, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
AVX2_INLINE i32x16 dpbusd_offset128_epi32(i32x16 src, i32x16 a, i32x16 b) {
  i32x16 out{dpbusd_offset128_half(src.lo, a.lo, b.lo), dpbusd_offset128_half(src.hi, a.hi, b.hi)};
  keep_chain(out.lo, out.hi);
  return out;
}
AVX2_INLINE int32_t dpbusd_offset128_start(int32_t) { return 0; }
#endif

// Eight bfloat16 pairs as float32: each pair's even element (its low word) and its odd one. A
// bfloat16 is the high half of the float32 of the same bits, so each is one shift or one mask.
AVX2_INLINE __m256 bf16_even_half(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
AVX2_INLINE __m256 bf16_odd_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// Per float lane, src + a_odd * b_odd + a_even * b_even over bfloat16 pairs (each product exact).
AVX2_INLINE __m256 dpbf16_half(__m256 src, __m256i a, __m256i b) {
  const __m256 odd = _mm256_fmadd_ps(bf16_odd_half(a), bf16_odd_half(b), src);
  return _mm256_fmadd_ps(bf16_even_half(a), bf16_even_half(b), odd);
}
AVX2_INLINE f32x16 dpbf16_ps(f32x16 src, i32x16 a, i32x16 b) {
  return {dpbf16_half(src.lo, a.lo, b.lo), dpbf16_half(src.hi, a.hi, b.hi)};
}

}  // namespace avx512_on_avx2

AVX2_INLINE avx512_on_avx2::i32x16 as_bf16_pairs(avx512_on_avx2::i32x16 v) { return v; }
using avx512_on_avx2::nibble_dot;
using avx512_on_avx2::nibble_sum;
using avx512_on_avx2::nibble_total;
using avx512_on_avx2::nibble_zero;
using avx512_on_avx2::dpbusd_offset128_epi32;
using avx512_on_avx2::dpbusd_offset128_start;

// The kernels' names for them.
#define __m512 avx512_on_avx2::f32x16
#define __m512i avx512_on_avx2::i32x16
#define __m512bh avx512_on_avx2::i32x16
#define AVX512_ON_AVX2(name) avx512_on_avx2::name
#undef _cvtu32_mask16
#define _cvtu32_mask16(x) static_cast<__mmask16>(x)
#undef _mm512_setzero_ps
#define _mm512_setzero_ps AVX512_ON_AVX2(setzero_ps)
#undef _mm512_set1_ps
#define _mm512_set1_ps AVX512_ON_AVX2(set1_ps)
#undef _mm512_setr_ps
#define _mm512_setr_ps AVX512_ON_AVX2(setr_ps)
#undef _mm512_add_ps
#define _mm512_add_ps AVX512_ON_AVX2(add_ps)
#undef _mm512_sub_ps
#define _mm512_sub_ps AVX512_ON_AVX2(sub_ps)
#undef _mm512_mul_ps
#define _mm512_mul_ps AVX512_ON_AVX2(mul_ps)
#undef _mm512_div_ps
#define _mm512_div_ps AVX512_ON_AVX2(div_ps)
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps AVX512_ON_AVX2(fmadd_ps)
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps AVX512_ON_AVX2(fnmadd_ps)
#undef _mm512_max_ps
#define _mm512_max_ps AVX512_ON_AVX2(max_ps)
#undef _mm512_min_ps
#define _mm512_min_ps AVX512_ON_AVX2(min_ps)
#undef _mm512_abs_ps
#define _mm512_abs_ps AVX512_ON_AVX2(abs_ps)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps AVX512_ON_AVX2(reduce_add_ps)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps AVX512_ON_AVX2(reduce_max_ps)
#undef _mm512_loadu_ps
#define _mm512_loadu_ps AVX512_ON_AVX2(loadu_ps)
#undef _mm512_storeu_ps
#define _mm512_storeu_ps AVX512_ON_AVX2(storeu_ps)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps AVX512_ON_AVX2(maskz_loadu_ps)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps AVX512_ON_AVX2(mask_storeu_ps)
#undef _mm512_mask_mov_ps
#define _mm512_mask_mov_ps AVX512_ON_AVX2(mask_mov_ps)
#undef _mm512_mask_add_ps
#define _mm512_mask_add_ps AVX512_ON_AVX2(mask_add_ps)
#undef _mm512_mask_max_ps
#define _mm512_mask_max_ps AVX512_ON_AVX2(mask_max_ps)
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, predicate) AVX512_ON_AVX2(cmp_ps_mask<(predicate)>)(a, b)
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask(mask, a, b, predicate) \
  static_cast<__mmask16>((mask) & AVX512_ON_AVX2(cmp_ps_mask<(predicate)>)(a, b))
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, immediate) AVX512_ON_AVX2(roundscale_ps<(immediate)>)(a)
#undef _mm512_scalef_ps
#define _mm512_scalef_ps AVX512_ON_AVX2(scalef_ps)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps AVX512_ON_AVX2(cvtph_ps)
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 AVX512_ON_AVX2(cvtps_epi32)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps AVX512_ON_AVX2(cvtepi32_ps)
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 AVX512_ON_AVX2(cvtepi32_epi8)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 AVX512_ON_AVX2(cvtepi32_epi16)
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 AVX512_ON_AVX2(cvtepu8_epi32)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 AVX512_ON_AVX2(cvtepi8_epi32)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 AVX512_ON_AVX2(cvtepu16_epi32)
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh AVX512_ON_AVX2(cvtneps_pbh)
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 AVX512_ON_AVX2(set1_epi32)
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 AVX512_ON_AVX2(set1_epi8)
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 AVX512_ON_AVX2(setr_epi32)
#undef _mm512_add_epi32
#define _mm512_add_epi32 AVX512_ON_AVX2(add_epi32)
#undef _mm512_and_si512
#define _mm512_and_si512 AVX512_ON_AVX2(and_si512)
#undef _mm512_or_si512
#define _mm512_or_si512 AVX512_ON_AVX2(or_si512)
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 AVX512_ON_AVX2(slli_epi32)
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 AVX512_ON_AVX2(srli_epi32)
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 AVX512_ON_AVX2(srli_epi16)
#undef _mm512_slli_epi16
#define _mm512_slli_epi16 AVX512_ON_AVX2(slli_epi16)
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 AVX512_ON_AVX2(reduce_add_epi32)
#undef _mm512_mask_mov_epi32
#define _mm512_mask_mov_epi32 AVX512_ON_AVX2(mask_mov_epi32)
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps AVX512_ON_AVX2(castsi512_ps)
#undef _mm512_castps_si512
#define _mm512_castps_si512 AVX512_ON_AVX2(castps_si512)
#undef _mm512_castsi256_si512
#define _mm512_castsi256_si512 AVX512_ON_AVX2(castsi256_si512)
#undef _mm512_inserti64x4
#define _mm512_inserti64x4(a, b, which) AVX512_ON_AVX2(inserti64x4<(which)>)(a, b)
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 AVX512_ON_AVX2(loadu_si512)
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 AVX512_ON_AVX2(storeu_si512)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 AVX512_ON_AVX2(maskz_loadu_epi16)
#undef _mm512_mask_storeu_epi16
#define _mm512_mask_storeu_epi16 AVX512_ON_AVX2(mask_storeu_epi16)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 AVX512_ON_AVX2(maskz_loadu_epi16_256)
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 AVX512_ON_AVX2(mask_storeu_epi16_256)
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps(a, b, immediate) AVX512_ON_AVX2(shuffle_ps<(immediate)>)(a, b)
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, immediate) AVX512_ON_AVX2(shuffle_f32x4<(immediate)>)(a, b)
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps AVX512_ON_AVX2(permutexvar_ps)
#undef _mm512_permutexvar_epi16
#define _mm512_permutexvar_epi16 AVX512_ON_AVX2(permutexvar_epi16)
#undef _mm512_maskz_compress_ps
#define _mm512_maskz_compress_ps AVX512_ON_AVX2(maskz_compress_ps)
#undef _mm512_maskz_compress_epi32
#define _mm512_maskz_compress_epi32 AVX512_ON_AVX2(maskz_compress_epi32)
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 AVX512_ON_AVX2(dpbusd_epi32)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps AVX512_ON_AVX2(dpbf16_ps)

#endif

// ---- bfloat16 as float32, in either build ----
// 16 bfloat16 widened to float32 (exact: a bfloat16 is the high half of the float32 of the same bits).
inline __m512 bf16_to_ps(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }
// 32 bfloat16 read as 16 pairs: each pair's even element (its low word), and its odd one, as float32,
// without the lane-crossing of a widening.
inline __m512 bf16_even_ps(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 bf16_odd_ps(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
