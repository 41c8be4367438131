// A probe, not a kernel the package uses: bf16 products y = x W^T for 1-16 rows on AMX tiles, with W read from the
// exact 4-bit and 8-bit blocks draftsmith.engine.blockquant packs (w = fma(d, q, m), rounded to bf16 as the bf16
// model's weights are). Each block of 16 output features x 32 inputs is widened to bf16 in memory (a 16-entry
// lookup per feature for 4 bits) and multiplied as the A tile; the rows' inputs, arranged once per call in the
// pairs layout, are the B tile. Rows never mix (each output is its own chain of tile products over the blocks, in
// order), so one row gives the same bits alone or beside 15 others. Built and timed by
// benchmarks/amx_packed_probe.py, which asks whether a verification step could read the packed bytes in bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <vector>
#include <algorithm>

namespace {
constexpr int64_t QB = 32;
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };

bool amx_permitted() {
  static const bool ok = [] { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }();
  return ok;
}

inline void cfg(int R) {
  TileCfg c{};
  c.palette = 1;
  for (int t = 0; t < 4; ++t) { c.rows[t] = 16; c.colsb[t] = 4 * R; }  // C tiles: 16 features x R tokens fp32
  c.rows[4] = 16; c.colsb[4] = 4 * R;  // B: 16 pairs x R tokens x 2 bf16
  c.rows[5] = 16; c.colsb[5] = 64;  // A: 16 features x 32 bf16
  c.rows[6] = 16; c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

const __m512 kIota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

template <int BITS>
inline void decode16(const uint8_t* Q, const float* D, const float* M, int64_t row_bytes, int64_t nb, int64_t j0,
                     int64_t c, uint16_t* A) {
  for (int i = 0; i < 16; ++i) {
    const int64_t j = j0 + i;
    const float d = D[j * nb + c], m = M[j * nb + c];
    if constexpr (BITS == 4) {
      const uint8_t* p = Q + j * row_bytes + c * 16;
      const __m512 tf = _mm512_fmadd_ps(_mm512_set1_ps(d), kIota, _mm512_set1_ps(m));
      const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(tf));
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
      const __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
      const __m256i hi = _mm256_srli_epi16(b, 4);
      const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(A + i * 32, _mm512_permutexvar_epi16(idx, table));
    } else {
      const int8_t* p = (const int8_t*)(Q + j * row_bytes + c * 32);
      const __m512 D16 = _mm512_set1_ps(d), M16 = _mm512_set1_ps(m);
      const __m512 w0 = _mm512_fmadd_ps(D16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), M16);
      const __m512 w1 = _mm512_fmadd_ps(D16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))), M16);
      _mm512_storeu_si512(A + i * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
}

template <int BITS>
void kernel(const uint32_t* XB, const uint8_t* Q, const float* D, const float* M, const float* B, c10::BFloat16* O,
            int R, int64_t k, int64_t n) {
  const int64_t nb = k / QB, row_bytes = k * BITS / 8, groups = n / 64;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    cfg(R);
    alignas(64) uint16_t A[4][16 * 32];
    alignas(64) float C[4][16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * 64;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t c = 0; c < nb; ++c) {
        _tile_loadd(4, XB + c * 16 * R, 4 * R);
        decode16<BITS>(Q, D, M, row_bytes, nb, j0, c, A[0]);
        _tile_loadd(5, A[0], 64);
        decode16<BITS>(Q, D, M, row_bytes, nb, j0 + 16, c, A[1]);
        _tile_loadd(6, A[1], 64);
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 6, 4);
        decode16<BITS>(Q, D, M, row_bytes, nb, j0 + 32, c, A[2]);
        _tile_loadd(5, A[2], 64);
        decode16<BITS>(Q, D, M, row_bytes, nb, j0 + 48, c, A[3]);
        _tile_loadd(6, A[3], 64);
        _tile_dpbf16ps(2, 5, 4);
        _tile_dpbf16ps(3, 6, 4);
      }
      _tile_stored(0, C[0], 4 * R); _tile_stored(1, C[1], 4 * R);
      _tile_stored(2, C[2], 4 * R); _tile_stored(3, C[3], 4 * R);
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 16; ++i) {
          const int64_t j = j0 + 16 * q + i;
          const float b = B ? B[j] : 0.f;
          for (int t = 0; t < R; ++t) O[t * n + j] = c10::BFloat16(C[q][i * R + t] + b);
        }
    }
    _tile_release();
  });
}

at::Tensor rows_linear_qbf(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), "no AMX permission");
  const int64_t k = x.size(-1), n = q.size(0);
  TORCH_CHECK(n % 64 == 0 && k % QB == 0);
  auto xc = x.reshape({-1, k}).contiguous();
  const int64_t rows = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = at::empty({rows, n}, x.options());
  const float* bp = (bias.has_value() && bias->defined()) ? bias->data_ptr<float>() : nullptr;
  const int64_t nb = k / QB;
  std::vector<uint32_t> XB(nb * 16 * 16);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int R = (int)std::min<int64_t>(16, rows - r0);
    const uint32_t* xs = (const uint32_t*)xc.data_ptr<c10::BFloat16>() + r0 * (k / 2);
    for (int t = 0; t < R; ++t)
      for (int64_t pr = 0; pr < k / 2; ++pr) XB[pr * R + t] = xs[t * (k / 2) + pr];
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + r0 * n;
    if (bits == 4) kernel<4>(XB.data(), (const uint8_t*)q.data_ptr(), d.data_ptr<float>(), m.data_ptr<float>(), bp, o, R, k, n);
    else kernel<8>(XB.data(), (const uint8_t*)q.data_ptr(), d.data_ptr<float>(), m.data_ptr<float>(), bp, o, R, k, n);
  }
  return out.view(shape);
}
}  // namespace

TORCH_LIBRARY(draftsmith_amx_probe, m) { m.def("qbf(Tensor x, Tensor q, Tensor d, Tensor m, int bits, Tensor? bias=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(draftsmith_amx_probe, CPU, m) { m.impl("qbf", &rows_linear_qbf); }
