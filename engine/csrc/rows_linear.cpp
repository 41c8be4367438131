// y = x W^T (+ b) for the few rows of a decoding step (1 for plain decoding and drafting, K+1 for a
// verification), float32 or bfloat16, W row-major [out, in] as torch stores it.
//
// A step over one or a few rows is bound by reading the weights: each weight is used once per row. On a 2-core
// AMD EPYC with AVX2 only (torch 2.13's MKL), MKL's float32 product reads the 49152 x 576 LM head at about
// 10 GB/s for one row and slower for 2-4 rows, where the machine reads memory at about 24 GB/s; a bfloat16
// product there has no bf16 instructions to run on and is slower still. This kernel streams each weight row
// once and multiplies it with up to four input rows while it is in L1, threads splitting the output columns, so
// it reads at close to the machine's bandwidth for a few rows. For many rows (a prompt, in bf16) it walks the
// weights in blocks that stay in L2, so that the inputs are read from L1 (`rows_kernel`).

// bfloat16: the weights are widened to float32 in registers as they are loaded (a bf16 number is the upper half
// of a float32's bits), the inputs once before the products; products and sums in float32, the bias added in
// float32, one rounding to bf16 at the end.
//
// bfloat16 on a CPU with AVX512_BF16 (the build with DRAFTSMITH_AVX512_BF16): VDPBF16PS multiplies 32 bf16 pairs of
// weights and inputs exactly and adds each pair into one of 16 float32 sums, one instruction where widening takes
// a load, a conversion, a shift and a multiply-add per 16 (`dots` on bf16 inputs); inputs stay bf16. Its sums round after each
// pair and treat subnormal inputs as zero, so its bits differ from the widened chain's (both are within float32's
// accumulation error of the exact product); the rest as above.
//
// Each output element is the same chain of operations whatever the number of rows (see `dots`). So a row's outputs
// are bit-identical whether it is multiplied alone or with a hundred others, and a verification's logits equal
// plain decoding's where the inputs are equal.
//
// Built with the decode attention kernel by draftsmith.engine.native; registered as
// draftsmith_native::rows_linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "widen.h"

#if defined(DRAFTSMITH_AVX512_BF16)
#include <immintrin.h>
#endif

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t VL = fVec::size();

// weights as float32 vectors: float32 loaded, bf16 widened exactly (widen.h)
using draftsmith_native_vec::load_f;

// Output column j for R input rows (R <= 4): weight row w against input rows x[0..R), k elements each. Each
// weight vector is loaded once for the R rows. Every element is the same chain whatever R: two vector
// accumulators over alternate blocks of the input, a last odd block into the first, their sum reduced in a fixed
// order, then the scalar tail.
template <int R, typename T>
inline void dots(const T* w, const float* const* x, int64_t k, float* out) {
  fVec a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = fVec(0.f);
  int64_t i = 0;
  for (; i + 2 * VL <= k; i += 2 * VL) {
    const fVec w0 = load_f(w + i), w1 = load_f(w + i + VL);
    for (int r = 0; r < R; ++r) {
      a0[r] = at::vec::fmadd(w0, fVec::loadu(x[r] + i), a0[r]);
      a1[r] = at::vec::fmadd(w1, fVec::loadu(x[r] + i + VL), a1[r]);
    }
  }
  if (i + VL <= k) {
    const fVec w0 = load_f(w + i);
    for (int r = 0; r < R; ++r) a0[r] = at::vec::fmadd(w0, fVec::loadu(x[r] + i), a0[r]);
    i += VL;
  }
  for (int r = 0; r < R; ++r) {
    float s = at::vec::vec_reduce_all<float>([](fVec& p, fVec& q) { return p + q; }, a0[r] + a1[r]);
    for (int64_t t = i; t < k; ++t) s += static_cast<float>(w[t]) * x[r][t];
    out[r] = s;
  }
}

#if defined(DRAFTSMITH_AVX512_BF16)
// `dots` for bf16 weights and bf16 inputs (not widened) with VDPBF16PS: two float32 accumulators over alternate blocks of 32 numbers,
// a last odd block into the first, their sum reduced in a fixed order, then the scalar tail (widened products).
template <int R>
inline void dots(const c10::BFloat16* w, const c10::BFloat16* const* x, int64_t k, float* out) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + i));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + i + 32));
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512((const void*)(x[r] + i)));
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_loadu_si512((const void*)(x[r] + i + 32)));
    }
  }
  if (i + 32 <= k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + i));
    for (int r = 0; r < R; ++r)
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512((const void*)(x[r] + i)));
    i += 32;
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    for (int64_t t = i; t < k; ++t) s += static_cast<float>(w[t]) * static_cast<float>(x[r][t]);
    out[r] = s;
  }
}

#endif

// O [m, n] = X [m, k] times W [n, k] transposed, plus B [n] (or none), W, B and O of dtype T (float or bf16), the
// inputs X as `dots` takes them (float32, or bf16 for VDPBF16PS); each sum is rounded to T once.
template <typename T, typename XT>
void rows_walk(const XT* X, const T* W, const T* B, T* O, int64_t m, int64_t k, int64_t n) {
  // Threads split the weight rows. Each walks its rows in blocks that stay in L2 (about 64 KB); for each block,
  // the input rows in groups of four (in L1) meet the block's weight rows one by one. One input row reads every
  // weight once from memory (plain decoding); a prompt's hundred rows read a block from memory once and from L2
  // for every further group of four, instead of reading all the inputs from L2 for every weight row.
  // The first group asks for the weight rows a few KB ahead of the one it multiplies (`prefetch_bytes`).
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
  const int64_t block = std::max<int64_t>(1, 65536 / row_bytes);
  const int64_t ahead = draftsmith_native_vec::prefetch_rows(row_bytes);
  // from how many input rows a group prefetches: float32 inputs (float32 weights, or bf16 ones widened) from 2,
  // VDPBF16PS (bf16 inputs) from 4; below that the hardware prefetcher keeps up, and asking costs time
  const int from = std::is_same<XT, float>::value ? 2 : 4;
  // grain: 64 weight rows or more a task, so a small matrix is not split into slivers
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    const XT* xs[4];
    float part[4];
    for (int64_t b0 = lo; b0 < hi; b0 += block) {
      const int64_t b1 = std::min(hi, b0 + block);
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int g = static_cast<int>(std::min<int64_t>(4, m - r0));
        for (int r = 0; r < g; ++r) xs[r] = X + (r0 + r) * k;
        for (int64_t j = b0; j < b1; ++j) {
          const T* wr = W + j * k;
          // the first group reads the weights from memory: the rows `ahead` on are asked for now
          if (r0 == 0 && g >= from && ahead > 0 && j + ahead < hi)
            draftsmith_native_vec::prefetch(W + (j + ahead) * k, row_bytes);
          const float b = B ? static_cast<float>(B[j]) : 0.f;
          switch (g) {
            case 1: dots<1>(wr, xs, k, part); break;
            case 2: dots<2>(wr, xs, k, part); break;
            case 3: dots<3>(wr, xs, k, part); break;
            default: dots<4>(wr, xs, k, part); break;
          }
          for (int r = 0; r < g; ++r) O[(r0 + r) * n + j] = static_cast<T>(part[r] + b);  // bf16: nearest even
        }
      }
    }
  });
}

// `rows_walk` with the inputs widened to float32 once (Xf), the weights as they are read
template <typename T>
void rows_kernel(const T* X, const T* W, const T* B, T* O, int64_t m, int64_t k, int64_t n) {
  std::vector<float> xf;
  const float* Xf = reinterpret_cast<const float*>(X);
  if (!std::is_same<T, float>::value) {
    xf.resize(m * k);
    for (int64_t t = 0; t < m * k; ++t) xf[t] = static_cast<float>(X[t]);
    Xf = xf.data();
  }
  rows_walk<T, float>(Xf, W, B, O, m, k, n);
}

// widen: bf16 by the widened float32 chain even where the build has VDPBF16PS (the reference the tests compare with)
at::Tensor rows_linear_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            bool widen) {
  const auto dt = w.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && x.scalar_type() == dt,
              "rows_linear: float32 or bfloat16 inputs and weights of one dtype, got ", x.scalar_type(), " and ", dt);
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "rows_linear: x [..., ", x.size(-1), "] against W ",
              w.sizes());
  auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  auto wc = w.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = wc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = at::empty({m, n}, x.options());
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dt && bias->numel() == n, "rows_linear: a bias of ", n, " numbers in ", dt);
    bc = bias->contiguous();
  }
  if (dt == at::kFloat) {
    rows_kernel<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr,
                       out.data_ptr<float>(), m, k, n);
  } else {
    using B16 = c10::BFloat16;
#if defined(DRAFTSMITH_AVX512_BF16)
    if (!widen) {
      rows_walk<B16, B16>(xc.data_ptr<B16>(), wc.data_ptr<B16>(), bc.defined() ? bc.data_ptr<B16>() : nullptr,
                          out.data_ptr<B16>(), m, k, n);
      return out.view(shape);
    }
#endif
    rows_kernel<B16>(xc.data_ptr<B16>(), wc.data_ptr<B16>(), bc.defined() ? bc.data_ptr<B16>() : nullptr,
                     out.data_ptr<B16>(), m, k, n);
  }
  return out.view(shape);
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return rows_linear_impl(x, w, bias, false);
}

// Set how far ahead the row kernels ask for weights (bytes, 0: off) and return the previous setting.
int64_t set_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (int64_t{1} << 20), "set_prefetch_bytes: 0 .. 1 MiB, got ", bytes);
  return draftsmith_native_vec::prefetch_bytes().exchange(bytes);
}

// the widened chain, whatever the build: a reference for the tests and benchmarks
at::Tensor rows_linear_widened(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return rows_linear_impl(x, w, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftsmith_native, m) {
  m.def("rows_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("rows_linear_widened(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("set_prefetch_bytes(int bytes) -> int", &set_prefetch_bytes);
}

TORCH_LIBRARY_IMPL(draftsmith_native, CPU, m) {
  m.impl("rows_linear", &rows_linear);
  m.impl("rows_linear_widened", &rows_linear_widened);
}
