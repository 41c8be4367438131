// Loads for the native kernels: VL float32 numbers, or VL bfloat16 numbers widened exactly to float32 (a bf16
// number is the upper half of a float32's bits: zero-extended to 32 bits and shifted into place), and rows_linear's
// weight prefetch. Included by ragged_attention.cpp and rows_linear.cpp, which are built together for one vector
// capability.

#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <atomic>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace draftsmith_native_vec {

using fVec = at::vec::Vectorized<float>;

inline fVec load_f(const float* p) { return fVec::loadu(p); }

inline fVec load_f(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)));
#else
  float tmp[fVec::size()];
  for (int64_t x = 0; x < fVec::size(); ++x) tmp[x] = static_cast<float>(p[x]);
  return fVec::loadu(tmp);
#endif
}

// How far ahead of the weight row being multiplied rows_linear asks the memory for the next rows, into L2, in bytes
// (0: not at all; `set_prefetch_bytes`). Without it, the products of four or more input rows per weight row are
// slow enough that the hardware prefetcher alone keeps too few reads in flight: on a 2-core Zen 4, four bf16 rows
// took 1.4x as long as three, which took about as long as one (docs/results-log.md §51). Asked 4 KB ahead, the
// model's bf16 linears took 0.66-0.77x as long at 4-8 rows; at 1-3 rows whole bf16 steps took 1-5% longer, so
// rows_linear asks from 4 rows for bf16 inputs and from 2 for float32 ones (into L1 instead: 1.1x at 1-3 rows).
// rows_linear_q does not ask: widening its 4-bit blocks, not reading them, bounds it (0.98-1.14x with it).
inline std::atomic<int64_t>& prefetch_bytes() {
  static std::atomic<int64_t> bytes{4096};
  return bytes;
}

// Weight rows to ask ahead: `prefetch_bytes` in rows of `row_bytes` (0 when off).
inline int64_t prefetch_rows(int64_t row_bytes) {
  const int64_t b = prefetch_bytes().load(std::memory_order_relaxed);
  return b > 0 ? (b + row_bytes - 1) / row_bytes : 0;
}

// Ask for `bytes` bytes from `p` on into L2 (prefetcht1; a hint: no fault, no effect on any result).
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

}  // namespace draftsmith_native_vec
