// One-token ("decode") attention over a ragged KV cache: row i's query attends to its own slots [0, last[i]].
//
// The data engine keeps one cache row per sequence in flight, each of its own length. Padded attention
// (one SDPA call over the longest row's span, the rest masked) reads and multiplies every row up to the
// longest; one SDPA call per row pays a dispatch per row and layer. This kernel reads each row's own
// entries once, for all query heads that share a key/value head (grouped-query attention), with float32
// accumulation and a two-pass softmax, parallel over (row, key/value head).
//
// With bfloat16 keys on a CPU with AVX512_BF16 (built with DRAFTSMITH_AVX512_BF16), scores are computed 16 slots
// at a time: VDPBF16PS multiplies bf16 pairs exactly and sums them in float32 (two instructions per slot and
// query head, where converting to float32 first takes four loads, eight conversions and four multiply-adds), and
// the 16 slots' vectors are reduced together by a transpose-and-add tree (15 shuffles and adds, where one
// horizontal sum per slot takes 8). Float32 scores on AVX-512 are reduced 16 slots at a time by the same tree.
// Keys and values are prefetched two blocks of slots ahead, in every build and dtype.
//
// The value pass keeps its accumulators in registers (up to 8 query heads a key/value head, the head's columns in
// chunks that fit the vector registers; a general loop otherwise): held in memory, each slot's multiply-adds
// waited on stores of the last slot's. The jobs are split between threads by their slots,
// not their number.
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
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "widen.h"

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t VL = fVec::size();

using draftsmith_native_vec::load_f;

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

inline void prefetch(const void* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// lane j of the result = the sum of x[j]'s 16 lanes (a transpose-and-add tree)
inline __m512 reduce16(const __m512* x) {
  __m512 s1[8], s2[4];
  for (int k = 0; k < 8; ++k)
    s1[k] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(s1[2 * k]), b = _mm512_castps_pd(s1[2 * k + 1]);
    s2[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // s2[k], 128-bit lane l: lane l's partial sums of x[4k..4k+4); add the four lanes, keeping x's order
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xDD));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x88), _mm512_shuffle_f32x4(s2[2], s2[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
}

// The scores of G query heads (qv: float32, scaled, C vectors a head) against slots [t0, t0 + n) of keys K
// (n <= 16), into s[g * Lp + t0 ...], the 16 slots' sums reduced together
template <int C, typename T>
inline void score_block_f(const fVec* qv, const T* K, int64_t t0, int64_t n, int64_t G, int64_t d, float* s,
                          int64_t Lp) {
  __m512 x[16];
  for (int64_t g = 0; g < G; ++g) {
    const fVec* qg = qv + g * C;
    for (int64_t j = 0; j < n; ++j) {
      const T* kt = K + (t0 + j) * d;
      fVec a = qg[0] * load_f(kt);
      for (int c = 1; c < C; ++c) a = at::vec::fmadd(qg[c], load_f(kt + c * VL), a);
      x[j] = a;
    }
    for (int64_t j = n; j < 16; ++j) x[j] = _mm512_setzero_ps();
    _mm512_storeu_ps(s + g * Lp + t0, reduce16(x));
  }
}
#endif

#if defined(DRAFTSMITH_AVX512_BF16)

// The scores of G query heads (bf16, unscaled) against slots [t0, t0 + n) of bf16 keys K (n <= 16), times
// scale, into s[g * Lp + t0 ...]: VDPBF16PS multiplies bf16 pairs exactly and sums them in float32 (the
// general path scales the queries first, in float32: the same products, summed in another order).
template <int C2>
inline void score_block_bf16(const __m512bh* qb, const c10::BFloat16* K, int64_t t0, int64_t n, int64_t G,
                             int64_t d, float scale, float* s, int64_t Lp) {
  __m512 x[16];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t c2 = C2 ? C2 : d / 32;  // 0: the head size known only at run time
    const __m512bh* qg = qb + g * c2;
    for (int64_t j = 0; j < n; ++j) {
      const c10::BFloat16* kt = K + (t0 + j) * d;
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < c2; ++c)
        a = _mm512_dpbf16_ps(a, qg[c], (__m512bh)_mm512_loadu_si512((const void*)(kt + c * 32)));
      x[j] = a;
    }
    for (int64_t j = n; j < 16; ++j) x[j] = _mm512_setzero_ps();
    _mm512_storeu_ps(s + g * Lp + t0, _mm512_mul_ps(reduce16(x), _mm512_set1_ps(scale)));
  }
}
#endif

// The value pass: acc[g * C + c] = sum over slots t < L of s[g * Lp + t] * V[t, c * VL ...]. With the sizes known
// at compile time (values_fixed) the accumulators live in registers; values_any is the general loop.
template <typename T>
inline void prefetch_values(const T* V, int64_t t, int64_t L, int64_t d) {
  for (int64_t j = 0; j < VL && t + 2 * VL + j < L; ++j)
    for (int64_t x = 0; x < d * (int64_t)sizeof(T); x += 64) prefetch((const char*)(V + (t + 2 * VL + j) * d) + x);
}

template <int G, int CC, typename T>
void values_cols(const T* V, int64_t L, int64_t d, int64_t c0, int64_t C, const float* s, int64_t Lp, fVec* out) {
  // columns [c0, c0 + CC) of every head's accumulator: G * CC vectors, held in registers
  fVec acc[G * CC];
  for (int j = 0; j < G * CC; ++j) acc[j] = fVec(0.f);
  const T* Vc = V + c0 * VL;
  for (int64_t t0 = 0; t0 < L; t0 += VL) {
    if (c0 == 0) prefetch_values(V, t0, L, d);
    const int64_t t1 = std::min<int64_t>(L, t0 + VL);
    for (int64_t t = t0; t < t1; ++t) {
      const T* vt = Vc + t * d;
      fVec vc[CC];
      for (int c = 0; c < CC; ++c) vc[c] = load_f(vt + c * VL);
      for (int g = 0; g < G; ++g) {
        const fVec p(s[g * Lp + t]);
        for (int c = 0; c < CC; ++c) acc[g * CC + c] = at::vec::fmadd(p, vc[c], acc[g * CC + c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CC; ++c) out[g * C + c0 + c] = acc[g * CC + c];
}

template <int G, typename T>
void values_g(int64_t cc, int64_t C, const T* V, int64_t L, int64_t d, const float* s, int64_t Lp, fVec* out) {
  for (int64_t c0 = 0; c0 < C; c0 += cc) {
    if (cc == 8)
      values_cols<G, 8>(V, L, d, c0, C, s, Lp, out);
    else if (cc == 4)
      values_cols<G, 4>(V, L, d, c0, C, s, Lp, out);
    else
      values_cols<G, 2>(V, L, d, c0, C, s, Lp, out);
  }
}

// Up to 8 query heads a key/value head, and C (vectors a head) a multiple of 2: the columns in chunks of cc vectors,
// cc as large as fits the vector registers (G * cc accumulators, cc values, one weight: 32 registers with AVX-512;
// 16 with AVX2, where one over is allowed so that 3 heads take chunks of 4, half the passes over the values of
// chunks of 2, which timed no better); false otherwise.
template <typename T>
bool values_fixed(int64_t G, int64_t C, const T* V, int64_t L, int64_t d, const float* s, int64_t Lp, fVec* out) {
  if (G < 1 || G > 8 || C % 2 != 0) return false;
  const int64_t regs = VL == 16 ? 32 : 17;
  int64_t cc = 2;
  for (int64_t x : {8, 4})
    if (C % x == 0 && G * x + x + 1 <= regs) {
      cc = x;
      break;
    }
  switch (G) {
    case 1: values_g<1>(cc, C, V, L, d, s, Lp, out); break;
    case 2: values_g<2>(cc, C, V, L, d, s, Lp, out); break;
    case 3: values_g<3>(cc, C, V, L, d, s, Lp, out); break;
    case 4: values_g<4>(cc, C, V, L, d, s, Lp, out); break;
    case 5: values_g<5>(cc, C, V, L, d, s, Lp, out); break;
    case 6: values_g<6>(cc, C, V, L, d, s, Lp, out); break;
    case 7: values_g<7>(cc, C, V, L, d, s, Lp, out); break;
    default: values_g<8>(cc, C, V, L, d, s, Lp, out); break;
  }
  return true;
}

template <typename T>
void values_any(int64_t G, int64_t C, const T* V, int64_t L, int64_t d, const float* s, int64_t Lp, fVec* acc) {
  for (int64_t j = 0; j < G * C; ++j) acc[j] = fVec(0.f);
  for (int64_t t = 0; t < L; ++t) {
    if (t % VL == 0) prefetch_values(V, t, L, d);
    const T* vt = V + t * d;
    fVec vc[16];
    for (int64_t c = 0; c < C; ++c) vc[c] = load_f(vt + c * VL);
    for (int64_t g = 0; g < G; ++g) {
      const fVec p(s[g * Lp + t]);
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] = at::vec::fmadd(p, vc[c], acc[g * C + c]);
    }
  }
}

// allow (or null): [b, aw] booleans, row i seeing slot start + j of its span only where allow[i * aw + j] (a
// speculative block's tree mask; the slots before start are all seen)
template <typename T>
void ragged_kernel(const T* q, const T* k, const T* v, const int64_t* last, T* out, int64_t b, int64_t nh,
                   int64_t nk, int64_t d, int64_t ks0, int64_t ks1, float scale, const bool* allow = nullptr,
                   int64_t aw = 0, int64_t start = 0) {
  const int64_t G = nh / nk, C = d / VL;
#if defined(DRAFTSMITH_AVX512_BF16)
  const bool use_dp = std::is_same<T, c10::BFloat16>::value && d % 32 == 0;
#else
  const bool use_dp = false;
#endif
  // the jobs split into one contiguous range per thread by their slots (rows' lengths differ several-fold, so
  // equal numbers of jobs are unequal work)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), b * nk));
  std::vector<int64_t> bounds(parts + 1, b * nk);
  {
    int64_t total = 0;
    for (int64_t i = 0; i < b; ++i) total += (last[i] + 1) * nk;
    int64_t seen = 0, p = 1;
    bounds[0] = 0;
    for (int64_t job = 0; job < b * nk && p < parts; ++job) {
      seen += last[job / nk] + 1;
      while (p < parts && seen * parts >= total * p) bounds[p++] = job + 1;
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t pbegin, int64_t pend) {
    const int64_t begin = bounds[pbegin], end = bounds[pend];
    std::vector<fVec> qv(G * C), acc(G * C);
    std::vector<float> sc, inv(G), tmp(d);
#if defined(DRAFTSMITH_AVX512_BF16)
    std::vector<__m512bh> qb(G * (d / 32));
#endif
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / nk, h = job % nk;
      const int64_t L = last[i] + 1;
      const T* K = k + i * ks0 + h * ks1;
      const T* V = v + i * ks0 + h * ks1;
      if (!use_dp)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < C; ++c) qv[g * C + c] = load_f(q + (i * nh + h * G + g) * d + c * VL) * fVec(scale);
      const int64_t Lp = (L + VL - 1) / VL * VL;
      sc.resize(G * Lp);
      for (int64_t t = 0; t < std::min<int64_t>(L, 2 * VL); ++t) prefetch(K + t * d);
#if defined(DRAFTSMITH_AVX512_BF16)
      if (use_dp) {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < d / 32; ++c)
            qb[g * (d / 32) + c] = (__m512bh)_mm512_loadu_si512((const void*)(q + (i * nh + h * G + g) * d + c * 32));
      }
#endif
      for (int64_t t0 = 0; t0 < L; t0 += VL) {
        const int64_t n = std::min<int64_t>(VL, L - t0);
        // keys two blocks ahead and this block's values (read after the softmax), a cache line at a time
        for (int64_t j = 0; j < VL && t0 + j < L; ++j)
          for (int64_t x = 0; x < d * (int64_t)sizeof(T); x += 64) {
            if (t0 + 2 * VL + j < L) prefetch((const char*)(K + (t0 + 2 * VL + j) * d) + x);
            prefetch((const char*)(V + (t0 + j) * d) + x);
          }
#if defined(DRAFTSMITH_AVX512_BF16)
        if (use_dp) {
          const auto* Kb = reinterpret_cast<const c10::BFloat16*>(K);
          if (d == 64)
            score_block_bf16<2>(qb.data(), Kb, t0, n, G, d, scale, sc.data(), Lp);
          else if (d == 128)
            score_block_bf16<4>(qb.data(), Kb, t0, n, G, d, scale, sc.data(), Lp);
          else
            score_block_bf16<0>(qb.data(), Kb, t0, n, G, d, scale, sc.data(), Lp);
          continue;
        }
#endif
#if defined(CPU_CAPABILITY_AVX512)
        if (C == 4) {
          score_block_f<4>(qv.data(), K, t0, n, G, d, sc.data(), Lp);
          continue;
        }
#endif
        for (int64_t t = t0; t < t0 + n; ++t) {
          const T* kt = K + t * d;
          fVec kc[16];
          for (int64_t c = 0; c < C; ++c) kc[c] = load_f(kt + c * VL);
          for (int64_t g = 0; g < G; ++g) {
            fVec a = qv[g * C] * kc[0];
            for (int64_t c = 1; c < C; ++c) a = at::vec::fmadd(qv[g * C + c], kc[c], a);
            sc[g * Lp + t] = hsum(a);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = sc.data() + g * Lp;
        for (int64_t t = L; t < Lp; ++t) s[t] = -std::numeric_limits<float>::infinity();
        if (allow != nullptr)
          for (int64_t t = std::max<int64_t>(start, 0); t < L; ++t)
            if (!allow[i * aw + (t - start)]) s[t] = -std::numeric_limits<float>::infinity();
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
      if (!values_fixed(G, C, V, L, d, sc.data(), Lp, acc.data())) values_any(G, C, V, L, d, sc.data(), Lp, acc.data());
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

// A speculative block of b queries in one cache row (k, v [1, kv_heads, capacity, head_dim]), query i written at
// slot last[i], the first at start = last[0]: query i attends to slots [0, start) and to the block's slots
// start + j <= last[i] where allow[i, j] (the block's tree or causal mask, [b, aw]). The same kernel, every query
// reading the one row, the masked slots' scores -inf. (start is read from last, a tensor, so that a compiled
// graph does not specialise on it.)
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& last,
                           const at::Tensor& allow, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.size(0) == 1 && v.sizes() == k.sizes(),
              "block_attention: q [block, heads, head_dim]; k, v [1, kv_heads, capacity, head_dim]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && v.strides() == k.strides(),
              "block_attention: k and v need contiguous slots");
  const int64_t b = q.size(0), nh = q.size(1), d = q.size(2), nk = k.size(1);
  TORCH_CHECK(k.size(3) == d && nh % nk == 0, "block_attention: shapes do not match");
  TORCH_CHECK(d % VL == 0 && d / VL <= 16, "block_attention: head_dim must be a multiple of ", VL, " and at most ",
              16 * VL);
  TORCH_CHECK(last.numel() == b && allow.dim() == 2 && allow.size(0) == b && allow.scalar_type() == at::kBool,
              "block_attention: one last slot and one row of booleans per query");
  auto qc = q.contiguous();
  auto lc = last.to(at::kLong).contiguous();
  auto ac = allow.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t start = b > 0 ? lp[0] : 0;
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(lp[i] >= start && lp[i] < k.size(2) && lp[i] - start < ac.size(1), "block_attention: query ", i,
                " attends to slot ", lp[i], " outside its block [", start, ", ", start + ac.size(1), ") or the cache's ",
                k.size(2), " slots");
  auto out = at::empty_like(qc);
  const bool* ap = ac.data_ptr<bool>();
  if (q.scalar_type() == at::kFloat) {
    ragged_kernel<float>(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), lp, out.data_ptr<float>(),
                         b, nh, nk, d, 0, k.stride(1), static_cast<float>(scale), ap, ac.size(1), start);
  } else if (q.scalar_type() == at::kBFloat16) {
    ragged_kernel<c10::BFloat16>(qc.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(),
                                 v.data_ptr<c10::BFloat16>(), lp, out.data_ptr<c10::BFloat16>(), b, nh, nk, d, 0,
                                 k.stride(1), static_cast<float>(scale), ap, ac.size(1), start);
  } else {
    TORCH_CHECK(false, "block_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

TORCH_LIBRARY(draftsmith_native, m) {
  m.def("ragged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor last, float scale) -> Tensor");
  m.def("block_attention(Tensor q, Tensor k, Tensor v, Tensor last, Tensor allow, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftsmith_native, CPU, m) {
  m.impl("ragged_decode_attention", &ragged_decode_attention);
  m.impl("block_attention", &block_attention);
}
