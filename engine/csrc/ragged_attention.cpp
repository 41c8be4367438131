// One-token ("decode") attention over a ragged KV cache: row i's query attends to its own slots [0, last[i]].
//
// The data engine keeps one cache row per sequence in flight, each of its own length. Padded attention
// (one SDPA call over the longest row's span, the rest masked) reads and multiplies every row up to the
// longest; one SDPA call per row pays a dispatch per row and layer. This kernel reads each row's own
// entries once, for all query heads that share a key/value head (grouped-query attention), with float32
// accumulation and a two-pass softmax, parallel over (row, key/value head).
//
// Built on first use by draftsmith.engine.native (torch.utils.cpp_extension) for the CPU's vector
// capability (AVX-512, AVX2, or scalar), as inductor builds its own kernels; registered as
// draftsmith_native::ragged_decode_attention.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t VL = fVec::size();

inline fVec load_f(const float* p) { return fVec::loadu(p); }
inline fVec load_f(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)));
#else
  float tmp[VL];
  for (int64_t x = 0; x < VL; ++x) tmp[x] = static_cast<float>(p[x]);
  return fVec::loadu(tmp);
#endif
}

inline float hsum(const fVec& a) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(a);
#elif defined(CPU_CAPABILITY_AVX2)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, a);
#endif
}

template <typename T>
void ragged_kernel(const T* q, const T* k, const T* v, const int64_t* last, T* out, int64_t b, int64_t nh,
                   int64_t nk, int64_t d, int64_t ks0, int64_t ks1, float scale) {
  const int64_t G = nh / nk, C = d / VL;
  at::parallel_for(0, b * nk, 1, [&](int64_t begin, int64_t end) {
    std::vector<fVec> qv(G * C), acc(G * C);
    std::vector<float> sc, inv(G), tmp(d);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / nk, h = job % nk;
      const int64_t L = last[i] + 1;
      const T* K = k + i * ks0 + h * ks1;
      const T* V = v + i * ks0 + h * ks1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) qv[g * C + c] = load_f(q + (i * nh + h * G + g) * d + c * VL) * fVec(scale);
      const int64_t Lp = (L + VL - 1) / VL * VL;
      sc.resize(G * Lp);
      for (int64_t t = 0; t < L; ++t) {
        const T* kt = K + t * d;
        fVec kc[16];
        for (int64_t c = 0; c < C; ++c) kc[c] = load_f(kt + c * VL);
        for (int64_t g = 0; g < G; ++g) {
          fVec a = qv[g * C] * kc[0];
          for (int64_t c = 1; c < C; ++c) a = at::vec::fmadd(qv[g * C + c], kc[c], a);
          sc[g * Lp + t] = hsum(a);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = sc.data() + g * Lp;
        for (int64_t t = L; t < Lp; ++t) s[t] = -std::numeric_limits<float>::infinity();
        fVec mv(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < Lp; t += VL) mv = at::vec::maximum(mv, fVec::loadu(s + t));
        const fVec m(at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return at::vec::maximum(x, y); }, mv));
        fVec sv(0.f);
        for (int64_t t = 0; t < Lp; t += VL) {
          fVec e = (fVec::loadu(s + t) - m).exp_u20();
          e.store(s + t);
          sv = sv + e;
        }
        inv[g] = 1.f / at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, sv);
      }
      for (int64_t j = 0; j < G * C; ++j) acc[j] = fVec(0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vt = V + t * d;
        fVec vc[16];
        for (int64_t c = 0; c < C; ++c) vc[c] = load_f(vt + c * VL);
        for (int64_t g = 0; g < G; ++g) {
          const fVec p(sc[g * Lp + t]);
          for (int64_t c = 0; c < C; ++c) acc[g * C + c] = at::vec::fmadd(p, vc[c], acc[g * C + c]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (i * nh + h * G + g) * d;
        for (int64_t c = 0; c < C; ++c) (acc[g * C + c] * fVec(inv[g])).store(tmp.data() + c * VL);
        for (int64_t x = 0; x < d; ++x) o[x] = T(tmp[x]);
      }
    }
  });
}

}  // namespace

at::Tensor ragged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& last, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(),
              "ragged_decode_attention: q [rows, heads, head_dim]; k, v [cache rows, kv_heads, capacity, head_dim]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && v.strides() == k.strides(),
              "ragged_decode_attention: k and v need contiguous slots (stride(2) == head_dim, stride(3) == 1)");
  const int64_t b = q.size(0), nh = q.size(1), d = q.size(2), nk = k.size(1);
  TORCH_CHECK(k.size(0) >= b && k.size(3) == d && nh % nk == 0, "ragged_decode_attention: shapes do not match");
  TORCH_CHECK(d % VL == 0 && d / VL <= 16, "ragged_decode_attention: head_dim must be a multiple of ", VL,
              " and at most ", 16 * VL);
  TORCH_CHECK(last.numel() == b, "ragged_decode_attention: one last slot per row");
  auto qc = q.contiguous();
  auto lc = last.to(at::kLong).contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < k.size(2), "ragged_decode_attention: row ", i, " attends to slot ", lp[i],
                " outside the cache's ", k.size(2), " slots");
  auto out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    ragged_kernel<float>(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), lp, out.data_ptr<float>(),
                         b, nh, nk, d, k.stride(0), k.stride(1), static_cast<float>(scale));
  } else if (q.scalar_type() == at::kBFloat16) {
    ragged_kernel<c10::BFloat16>(qc.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(),
                                 v.data_ptr<c10::BFloat16>(), lp, out.data_ptr<c10::BFloat16>(), b, nh, nk, d,
                                 k.stride(0), k.stride(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "ragged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

TORCH_LIBRARY(draftsmith_native, m) {
  m.def("ragged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor last, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_native, CPU, m) { m.impl("ragged_decode_attention", &ragged_decode_attention); }
