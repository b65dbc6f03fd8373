// bfloat16 panels for cpu_matmul.cc (included there): half float32's weight bytes.
//
//   panels [P, K / 2, 16, 2] bfloat16 bits: for every pair of k, each of the 16 columns holds
//          (w[c, 2j], w[c, 2j + 1]) in one 32-bit lane, the layout AVX-512 BF16's vdpbf16ps
//          multiplies (16 lanes x 2 products per instruction, float32 sums)
//
// x is rounded to bfloat16 once per call, on every path (so a row's result does not depend on
// the batch it came in). With AVX-512 BF16 and two rows or more the micro-kernel runs
// vdpbf16ps on a 6 x 32 tile: half the instructions of float32's FMAs for the same work, on
// half the bytes. Elsewhere (and for one row, where the weights' bytes bound the time) the
// panels are widened to float32, exactly: in registers for one row, else decoded once per
// task into a float32 panel for the float micro-kernels.

#include <cstring>

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

typedef uint32_t u8x32 __attribute__((vector_size(32)));
typedef uint32_t u8x32u __attribute__((vector_size(32), aligned(2)));

inline uint16_t to_bf16(float f) {  // round to nearest even; a NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The even and odd k of 8 columns' pairs, as float32: the low half of each lane shifted up,
// the high half masked (both exact).
inline void widen8(const uint16_t* pairs, v8& even, v8& odd) {
  const u8x32 u = *reinterpret_cast<const u8x32u*>(pairs);
  const u8x32 lo = u << 16, hi = u & 0xffff0000u;
  std::memcpy(&even, &lo, 32);
  std::memcpy(&odd, &hi, 32);
}

// Panel [K / 2, 16, 2] -> float32 [K, 16] (k-major), for the float micro-kernels.
void decode_panel_bf16(const uint16_t* panel, int64_t K, float* out) {
  for (int64_t j = 0; j < K / 2; ++j)
    for (int half = 0; half < 2; ++half) {
      v8 even, odd;
      widen8(panel + j * 2 * kNR + half * kNR, even, odd);
      store(out + 2 * j * kNR + half * 8, even);
      store(out + (2 * j + 1) * kNR + half * 8, odd);
    }
}

// One row of x against a bfloat16 panel, widened in registers: 4 FMAs per pair of k.
void micro_row_bf16(const float* x, int64_t K, const uint16_t* panel, float* y, int64_t cols) {
  const v8 zero = {};
  v8 a0 = zero, a1 = zero, b0 = zero, b1 = zero;
  for (int64_t j = 0; j < K / 2; ++j) {
    v8 e0, o0, e1, o1;
    widen8(panel + j * 2 * kNR, e0, o0);
    widen8(panel + j * 2 * kNR + kNR, e1, o1);
    a0 += x[2 * j] * e0, a1 += x[2 * j] * e1;
    b0 += x[2 * j + 1] * o0, b1 += x[2 * j + 1] * o1;
  }
  float tile[kNR];
  store(tile, a0 + b0);
  store(tile + 8, a1 + b1);
  std::memcpy(y, tile, cols * sizeof(float));
}

// x [M, K] rounded to bfloat16: as pairs of k in 32-bit words (vdpbf16ps's broadcast) and
// widened back to float32 (the float paths multiply the same values).
void round_rows_bf16(const float* x, int64_t M, int64_t K, std::vector<uint32_t>& pairs,
                     std::vector<float>& widened) {
  pairs.resize(M * K / 2);
  widened.resize(M * K);
  for (int64_t i = 0; i < M * K / 2; ++i) {
    const uint32_t lo = to_bf16(x[2 * i]), hi = to_bf16(x[2 * i + 1]);
    pairs[i] = lo | hi << 16;
    const uint32_t wl = lo << 16, wh = hi << 16;
    std::memcpy(&widened[2 * i], &wl, 4);
    std::memcpy(&widened[2 * i + 1], &wh, 4);
  }
}

#ifdef __AVX512BF16__
constexpr int64_t kKPC = 128;  // pairs of k per chunk: 8 KB of each panel, in L1 with x's rows

// y[0..MR, 0..16 + cols_b) (+)= xb . (panel a | panel b) over `pairs` pairs of k.
template <int MR>
void micro_bf16x2(const uint32_t* xb, int64_t ldx, int64_t pairs, const uint16_t* pa,
                  const uint16_t* pb, float* y, int64_t ldy, int64_t cols_b, bool add) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 a0 = zero, a1 = zero, a2 = zero, a3 = zero, a4 = zero, a5 = zero;
  __m512 b0 = zero, b1 = zero, b2 = zero, b3 = zero, b4 = zero, b5 = zero;
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh wa = (__m512bh)_mm512_loadu_si512(pa + j * 2 * kNR);
    const __m512bh wb = (__m512bh)_mm512_loadu_si512(pb + j * 2 * kNR);
#define PJ_ROW(i)                                                              \
  if (MR > i) {                                                                \
    const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[i * ldx + j])); \
    a##i = _mm512_dpbf16_ps(a##i, xi, wa);                                     \
    b##i = _mm512_dpbf16_ps(b##i, xi, wb);                                     \
  }
    PJ_ROW(0) PJ_ROW(1) PJ_ROW(2) PJ_ROW(3) PJ_ROW(4) PJ_ROW(5)
#undef PJ_ROW
  }
  float tile[kNR];
#define PJ_OUT(i)                                                                          \
  if (MR > i) {                                                                            \
    float* row = y + i * ldy;                                                              \
    _mm512_storeu_ps(row, add ? _mm512_add_ps(_mm512_loadu_ps(row), a##i) : a##i);         \
    _mm512_storeu_ps(tile, b##i);                                                          \
    for (int64_t c = 0; c < cols_b; ++c) row[kNR + c] = (add ? row[kNR + c] : 0.f) + tile[c]; \
  }
  PJ_OUT(0) PJ_OUT(1) PJ_OUT(2) PJ_OUT(3) PJ_OUT(4) PJ_OUT(5)
#undef PJ_OUT
}

// mr <= 6 rows of x (as bfloat16 pairs) against two panels, by chunks of k.
void rows_pair_bf16(int64_t mr, const uint32_t* xb, int64_t K, const uint16_t* pa,
                    const uint16_t* pb, float* y, int64_t ldy, int64_t cols_b) {
  using Micro = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                         float*, int64_t, int64_t, bool);
  static constexpr Micro kMicro[7] = {nullptr,         micro_bf16x2<1>, micro_bf16x2<2>,
                                      micro_bf16x2<3>, micro_bf16x2<4>, micro_bf16x2<5>,
                                      micro_bf16x2<6>};
  const int64_t pairs = K / 2;
  for (int64_t j0 = 0; j0 < pairs; j0 += kKPC)
    kMicro[mr](xb + j0, pairs, std::min(kKPC, pairs - j0), pa + j0 * 2 * kNR,
               pb + j0 * 2 * kNR, y, ldy, cols_b, j0 > 0);
}
#else
// Never called without AVX-512 BF16 (kBf16Dot is false): it lets run_task's branch compile.
void rows_pair_bf16(int64_t, const uint32_t*, int64_t, const uint16_t*, const uint16_t*,
                    float*, int64_t, int64_t) {}
#endif
