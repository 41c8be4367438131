// Loads for the native kernels: VL float32 numbers, or VL bfloat16 numbers widened exactly to float32 (a bf16
// number is the upper half of a float32's bits: zero-extended to 32 bits and shifted into place). Included by
// ragged_attention.cpp and rows_linear.cpp, which are built together for one vector capability.

#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

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

}  // namespace draftsmith_native_vec
