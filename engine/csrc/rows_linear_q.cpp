// y = x W^T (+ b) for a decoding step's few float32 rows, where W is stored in blocks of 32 weights as small
// integers with a float32 scale and offset per block: w = fma(d, q, m), q 4-bit unsigned (two to a byte) or 8-bit
// signed. This is how a GGUF file's Q4_1 and Q8_0 tensors (and Q4_0, Q6_K-like formats) dequantise: the
// product d * q is exact in float32, so one fused multiply-add gives exactly the float32 number the dequantised
// model holds. draftsmith.engine.blockquant derives (d, q, m) from a float32 weight and keeps it only where every
// block reproduces the weight bit for bit.
//
// Each output element is the same chain of operations as rows_linear.cpp's float32 `dots`: the weights are
// widened to float32 in registers in the order that chain loads them, and multiplied with the inputs into the same
// two accumulators. So the outputs are bit-identical to rows_linear on the dequantised float32 weight, while each
// weight costs 4 or 8 bits of memory traffic instead of 32. A decoding step over one row is bound by reading the
// weights; this one reads a sixth of the bytes, and spends the time saved on widening them.
//
// Layout, per row of k weights (k a multiple of 32), per block of 32: 4-bit: 16 bytes, byte j holding weight j
// in its low nibble and weight j + 16 in its high nibble (the GGUF Q4 order); 8-bit: 32 bytes, one a weight.
// d and m: [n, k / 32] float32. "6-bit" (a GGUF file's Q6_K: q in -32..31 with a scale per 16 weights, an fp16
// number times an 8-bit integer, no offset): 8-bit storage, d and m [n, k / 16], m zero (fma(d, q, +0) rounds
// d * q once, as ggml's dequantisation does).
//
// Registered as draftsmith_native::rows_linear_q, built with the other kernels by draftsmith.engine.native.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t VL = fVec::size();
constexpr int64_t QB = 32;  // weights a block
constexpr int NV = static_cast<int>(QB / VL);  // vectors a block: 4 (AVX2, and the scalar build) or 2 (AVX-512)
#if defined(CPU_CAPABILITY_AVX512)
// input rows multiplied with a widened block while it is in registers: 8 rows keep 16 accumulators and the block in
// 20 of AVX-512's 32 vector registers; AVX2's 16 hold four rows' 8 accumulators and the block's 4 vectors
constexpr int RMAX = 8;
const __m512 kIota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
constexpr int RMAX = 4;
#endif

// stored bits a weight, and scales (and offsets) a block of 32
template <int BITS>
constexpr int stored_bits() { return BITS == 6 ? 8 : BITS; }
template <int BITS>
constexpr int64_t scales_per_block() { return BITS == 6 ? 2 : 1; }

// The block's 32 weights as NV float32 vectors, in element order: w[v] holds weights v * VL .. v * VL + VL - 1.
// d, m: the block's scales and offsets (one each; two for BITS 6, one per 16 weights).
template <int BITS>
inline void widen_block(const uint8_t* p, const float* d, const float* m, fVec* w) {
  if constexpr (BITS == 6) {
    const int8_t* s = reinterpret_cast<const int8_t*>(p);
    for (int v = 0; v < NV; ++v) {  // vector v holds weights v * VL .. v * VL + VL - 1: sub-block v * VL / 16
      const int sub = static_cast<int>(v * VL / 16);
#if defined(CPU_CAPABILITY_AVX512)
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + VL * v)));
      w[v] = at::vec::fmadd(fVec(d[sub]), fVec(_mm512_cvtepi32_ps(b)), fVec(m[sub]));
#elif defined(CPU_CAPABILITY_AVX2)
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + VL * v)));
      w[v] = at::vec::fmadd(fVec(d[sub]), fVec(_mm256_cvtepi32_ps(b)), fVec(m[sub]));
#else
      float q[VL];
      for (int j = 0; j < VL; ++j) q[j] = static_cast<float>(s[v * VL + j]);
      w[v] = at::vec::fmadd(fVec(d[sub]), fVec::loadu(q), fVec(m[sub]));
#endif
    }
    return;
  } else {
  const fVec D(*d), M(*m);
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  if constexpr (BITS == 4) {
    // bytes 0..7 hold weights 0..7 (low nibbles) and 16..23 (high); bytes 8..15: 8..15 and 24..31
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i lo = _mm256_set1_epi32(0x0F);
    w[0] = at::vec::fmadd(D, fVec(_mm256_cvtepi32_ps(_mm256_and_si256(b0, lo))), M);
    w[1] = at::vec::fmadd(D, fVec(_mm256_cvtepi32_ps(_mm256_and_si256(b1, lo))), M);
    w[2] = at::vec::fmadd(D, fVec(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4))), M);
    w[3] = at::vec::fmadd(D, fVec(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))), M);
  } else {
    const int8_t* s = reinterpret_cast<const int8_t*>(p);
    for (int v = 0; v < 4; ++v) {
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * v)));
      w[v] = at::vec::fmadd(D, fVec(_mm256_cvtepi32_ps(b)), M);
    }
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (BITS == 4) {
    // the block's 16 possible weights fma(d, q, m), q = 0..15, are one vector; each weight is looked up in it by
    // its nibble (the same numbers the widening below gives: one fused multiply-add each, exact products)
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(*d), kIota, _mm512_set1_ps(*m));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = fVec(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)), table));
    w[1] = fVec(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table));
  } else {
    const int8_t* s = reinterpret_cast<const int8_t*>(p);
    for (int v = 0; v < 2; ++v) {
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * v)));
      w[v] = at::vec::fmadd(D, fVec(_mm512_cvtepi32_ps(b)), M);
    }
  }
#else
  float q[QB];
  for (int j = 0; j < 16 && BITS == 4; ++j) {
    q[j] = static_cast<float>(p[j] & 0x0F);
    q[j + 16] = static_cast<float>(p[j] >> 4);
  }
  for (int j = 0; j < QB && BITS == 8; ++j) q[j] = static_cast<float>(reinterpret_cast<const int8_t*>(p)[j]);
  for (int v = 0; v < NV; ++v) w[v] = at::vec::fmadd(D, fVec::loadu(q + v * VL), M);
#endif
  }
}

// Output column j for R input rows (R <= RMAX), the chain of rows_linear.cpp's `dots` for k a multiple of 32: two
// vector accumulators over alternate vectors of the input, their sum reduced in the same fixed order.
template <int BITS, int R>
inline void qdots(const uint8_t* q, const float* d, const float* m, const float* const* x, int64_t k, float* out) {
  fVec a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = fVec(0.f);
  constexpr int64_t bytes = QB * stored_bits<BITS>() / 8, S = scales_per_block<BITS>();
  fVec w[NV];
  for (int64_t b = 0, i = 0; i < k; ++b, i += QB) {
    widen_block<BITS>(q + b * bytes, d + b * S, m + b * S, w);
    for (int v = 0; v < NV; v += 2) {
      for (int r = 0; r < R; ++r) {
        a0[r] = at::vec::fmadd(w[v], fVec::loadu(x[r] + i + v * VL), a0[r]);
        a1[r] = at::vec::fmadd(w[v + 1], fVec::loadu(x[r] + i + (v + 1) * VL), a1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = at::vec::vec_reduce_all<float>([](fVec& p, fVec& s) { return p + s; }, a0[r] + a1[r]);
}

template <int BITS>
void qrows_kernel(const float* X, const uint8_t* Q, const float* Dm, const float* Mm, const float* B, float* O,
                  int64_t m, int64_t k, int64_t n) {
  const int64_t nb = k / QB * scales_per_block<BITS>(), row_bytes = k * stored_bits<BITS>() / 8;
  // threads split the weight rows, each walking its own in blocks of about 64 KB (rows_linear.cpp's order)
  const int64_t block = std::max<int64_t>(1, 65536 / (row_bytes + 8 * nb));
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    const float* xs[RMAX];
    float part[RMAX];
    for (int64_t b0 = lo; b0 < hi; b0 += block) {
      const int64_t b1 = std::min(hi, b0 + block);
      for (int64_t r0 = 0; r0 < m; r0 += RMAX) {
        const int g = static_cast<int>(std::min<int64_t>(RMAX, m - r0));
        for (int r = 0; r < g; ++r) xs[r] = X + (r0 + r) * k;
        for (int64_t j = b0; j < b1; ++j) {
          const uint8_t* qr = Q + j * row_bytes;
          const float *dr = Dm + j * nb, *mr = Mm + j * nb;
          switch (g) {
            case 1: qdots<BITS, 1>(qr, dr, mr, xs, k, part); break;
            case 2: qdots<BITS, 2>(qr, dr, mr, xs, k, part); break;
            case 3: qdots<BITS, 3>(qr, dr, mr, xs, k, part); break;
#if defined(CPU_CAPABILITY_AVX512)
            case 4: qdots<BITS, 4>(qr, dr, mr, xs, k, part); break;
            case 5: qdots<BITS, 5>(qr, dr, mr, xs, k, part); break;
            case 6: qdots<BITS, 6>(qr, dr, mr, xs, k, part); break;
            case 7: qdots<BITS, 7>(qr, dr, mr, xs, k, part); break;
#endif
            default: qdots<BITS, RMAX>(qr, dr, mr, xs, k, part); break;
          }
          const float b = B ? B[j] : 0.f;
          for (int r = 0; r < g; ++r) O[(r0 + r) * n + j] = part[r] + b;
        }
      }
    }
  });
}

at::Tensor rows_linear_q(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                         int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "rows_linear_q: 4, 6 or 8 bits, got ", bits);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rows_linear_q: float32 inputs, got ", x.scalar_type());
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar) && q.dim() == 2,
              "rows_linear_q: ", bits, "-bit weights as a 2-d ", bits == 4 ? "uint8" : "int8", " tensor");
  const int64_t k = x.size(-1), n = q.size(0), stored = bits == 6 ? 8 : bits, per = bits == 6 ? 16 : QB;
  TORCH_CHECK(k % QB == 0 && q.size(1) * 8 == k * stored, "rows_linear_q: ", k, " inputs against packed weights ",
              q.sizes(), " of ", bits, " bits (k a multiple of ", QB, ")");
  TORCH_CHECK(d.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && d.numel() == n * (k / per) &&
                  m.numel() == d.numel(),
              "rows_linear_q: float32 scales and offsets, ", n, " x ", k / per);
  auto xc = x.reshape({-1, k}).contiguous();
  auto qc = q.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "rows_linear_q: a float32 bias of ", n);
    bc = bias->contiguous();
  }
  const int64_t rows = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = at::empty({rows, n}, x.options());
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  if (bits == 4)
    qrows_kernel<4>(xc.data_ptr<float>(), qp, dc.data_ptr<float>(), mc.data_ptr<float>(), bp, out.data_ptr<float>(),
                    rows, k, n);
  else if (bits == 6)
    qrows_kernel<6>(xc.data_ptr<float>(), qp, dc.data_ptr<float>(), mc.data_ptr<float>(), bp, out.data_ptr<float>(),
                    rows, k, n);
  else
    qrows_kernel<8>(xc.data_ptr<float>(), qp, dc.data_ptr<float>(), mc.data_ptr<float>(), bp, out.data_ptr<float>(),
                    rows, k, n);
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_native, m) {
  m.def("rows_linear_q(Tensor x, Tensor q, Tensor d, Tensor m, int bits, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_native, CPU, m) { m.impl("rows_linear_q", &rows_linear_q); }
